package dev.rlstream.kafbat;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.stream.Stream;
import org.apache.avro.AvroRuntimeException;
import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.message.SchemaStore;

/**
 * rlstream's shipped schemas ({@code <Name>.v<N>.avsc}) and a decoder for values in Avro
 * single-object encoding ({@code C3 01} + 8-byte little-endian CRC-64-AVRO fingerprint of the
 * writer schema's parsing canonical form + Avro binary body).
 *
 * <p>As in {@code pipeline.codec}: the writer schema is looked up by fingerprint among all shipped
 * versions, and the record is read with the newest version of the same name (schema resolution).
 * A schema may reference another record by name (ScoredTrajectory embeds rlstream.Trajectory): files
 * are parsed in rounds, each with the newest version of every name parsed so far.
 */
public final class SchemaSet {
  private static final Pattern FILE = Pattern.compile("^([A-Za-z]+)\\.v(\\d+)\\.avsc$");

  /** One shipped schema version. */
  public record Version(String name, int version, Schema schema, long fingerprint) {
    public String label() {
      return name + ".v" + version;
    }
  }

  /** A decoded value: its writer schema version and the record (read with the newest version). */
  public record Decoded(Version writer, GenericRecord record) {}

  private final Map<Long, Version> byFingerprint = new HashMap<>();
  private final Map<String, BinaryMessageDecoder<GenericRecord>> decoders = new HashMap<>();

  public SchemaSet(Path dir) throws IOException {
    List<Path> pending = new ArrayList<>();
    try (Stream<Path> files = Files.list(dir)) {
      files.filter(p -> p.getFileName().toString().endsWith(".avsc")).forEach(pending::add);
    }
    pending.sort(Comparator.comparing(SchemaSet::versionOf));
    if (pending.isEmpty()) {
      throw new IOException("no <Name>.v<N>.avsc files in " + dir);
    }
    Map<String, Version> latest = new HashMap<>();
    while (!pending.isEmpty()) {
      List<Path> deferred = new ArrayList<>();
      AvroRuntimeException lastError = null;
      for (Path file : pending) {
        Matcher m = FILE.matcher(file.getFileName().toString());
        if (!m.matches()) {
          throw new IOException("schema file name must be <Name>.v<N>.avsc: " + file);
        }
        Schema.Parser parser = new Schema.Parser();
        latest.forEach((name, v) -> {
          if (!name.equals(m.group(1))) {
            parser.addTypes(List.of(v.schema()));
          }
        });
        Schema schema;
        try {
          schema = parser.parse(file.toFile());
        } catch (AvroRuntimeException e) { // e.g. references a name not parsed yet
          deferred.add(file);
          lastError = e;
          continue;
        }
        long fp = SchemaNormalization.parsingFingerprint64(schema);
        Version v = new Version(m.group(1), Integer.parseInt(m.group(2)), schema, fp);
        byFingerprint.put(fp, v);
        latest.put(v.name(), v); // files come in version order
      }
      if (deferred.size() == pending.size()) {
        throw new IOException("cannot parse " + deferred + ": " + lastError.getMessage(), lastError);
      }
      pending = deferred;
    }
    SchemaStore.Cache store = new SchemaStore.Cache();
    byFingerprint.values().forEach(v -> store.addSchema(v.schema()));
    latest.forEach((name, v) -> decoders.put(name, new BinaryMessageDecoder<>(GenericData.get(), v.schema(), store)));
  }

  private static String versionOf(Path p) {
    Matcher m = FILE.matcher(p.getFileName().toString());
    return m.matches() ? String.format("%s.%09d", m.group(1), Integer.parseInt(m.group(2))) : p.toString();
  }

  public Map<Long, Version> versions() {
    return byFingerprint;
  }

  /** Decode one value; IllegalArgumentException for anything that is not an rlstream record. */
  public Decoded decode(byte[] data) {
    if (data == null || data.length < 10 || (data[0] & 0xff) != 0xC3 || data[1] != 0x01) {
      throw new IllegalArgumentException("not an rlstream Avro message (no C3 01 marker)");
    }
    long fp = ByteBuffer.wrap(data, 2, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
    Version writer = byFingerprint.get(fp);
    if (writer == null) {
      throw new IllegalArgumentException(String.format("unknown schema fingerprint %016x", Long.reverseBytes(fp)));
    }
    try {
      return new Decoded(writer, decoders.get(writer.name()).decode(data));
    } catch (IOException | RuntimeException e) {
      throw new IllegalArgumentException("corrupt " + writer.label() + " body: " + e, e);
    }
  }
}

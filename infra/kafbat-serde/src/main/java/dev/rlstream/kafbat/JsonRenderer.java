package dev.rlstream.kafbat;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.JsonNodeFactory;
import com.fasterxml.jackson.databind.node.ObjectNode;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.Base64;
import java.util.Collection;
import java.util.Map;
import org.apache.avro.generic.GenericEnumSymbol;
import org.apache.avro.generic.GenericFixed;
import org.apache.avro.generic.GenericRecord;

/**
 * Renders a decoded record as JSON, fields in schema order. Unions are plain values (no type
 * wrapper). The packed numeric fields of docs/reference/wire-format.md become arrays: {@code prompt_tokens}
 * and {@code response_tokens} (little-endian int32), {@code logprobs} (little-endian float32,
 * written in Java's shortest float form) and {@code loss_mask} (uint8). Non-finite numbers are the
 * strings {@code "NaN"}, {@code "Infinity"}, {@code "-Infinity"} (JSON has none). Every other {@code bytes}
 * value (DeadLetter's key, value and headers) is base64, as is a packed field whose length is not a
 * multiple of its element size. An embedded value ({@code trajectory_value} of ScoredTrajectory.v2:
 * the original Trajectory's bytes) is decoded into {@code trajectory} when that is null, as the
 * Python codec does.
 */
public final class JsonRenderer {
  private static final JsonNodeFactory F = JsonNodeFactory.instance;
  private static final Map<String, Integer> PACKED = Map.of(
      "prompt_tokens", 4, "response_tokens", 4, "logprobs", 4, "loss_mask", 1);

  private JsonRenderer() {}

  public static JsonNode render(GenericRecord record) {
    ObjectNode out = F.objectNode();
    for (var field : record.getSchema().getFields()) {
      out.set(field.name(), value(field.name(), record.get(field.pos())));
    }
    return out;
  }

  /** {@link #render(GenericRecord)}, with an embedded Trajectory value decoded by {@code schemas}. */
  public static JsonNode render(GenericRecord record, SchemaSet schemas) {
    ObjectNode out = (ObjectNode) render(record);
    if (record.getSchema().getField("trajectory_value") != null && record.get("trajectory") == null) {
      ByteBuffer b = ((ByteBuffer) record.get("trajectory_value")).duplicate();
      if (b.hasRemaining()) {
        byte[] raw = new byte[b.remaining()];
        b.get(raw);
        out.set("trajectory", render(schemas.decode(raw).record()));
      }
    }
    return out;
  }

  private static JsonNode value(String field, Object v) {
    if (v == null) {
      return F.nullNode();
    } else if (v instanceof GenericRecord r) {
      return render(r);
    } else if (v instanceof ByteBuffer b) {
      return bytes(field, b);
    } else if (v instanceof CharSequence || v instanceof GenericEnumSymbol<?>) {
      return F.textNode(v.toString());
    } else if (v instanceof Integer i) {
      return F.numberNode(i);
    } else if (v instanceof Long l) {
      return F.numberNode(l);
    } else if (v instanceof Float f) {
      return Float.isFinite(f) ? F.numberNode(f) : F.textNode(f.toString());
    } else if (v instanceof Double d) {
      return Double.isFinite(d) ? F.numberNode(d) : F.textNode(d.toString());
    } else if (v instanceof Boolean z) {
      return F.booleanNode(z);
    } else if (v instanceof GenericFixed x) {
      return F.textNode(Base64.getEncoder().encodeToString(x.bytes()));
    } else if (v instanceof Map<?, ?> m) {
      ObjectNode o = F.objectNode();
      m.forEach((k, item) -> o.set(k.toString(), value("", item)));
      return o;
    } else if (v instanceof Collection<?> c) {
      ArrayNode a = F.arrayNode();
      c.forEach(item -> a.add(value("", item)));
      return a;
    }
    throw new IllegalArgumentException("unexpected Avro value " + v.getClass() + " in field " + field);
  }

  private static JsonNode bytes(String field, ByteBuffer buf) {
    ByteBuffer b = buf.duplicate().order(ByteOrder.LITTLE_ENDIAN);
    Integer size = PACKED.get(field);
    if (size == null || b.remaining() % size != 0) {
      byte[] raw = new byte[b.remaining()];
      b.get(raw);
      return F.textNode(Base64.getEncoder().encodeToString(raw));
    }
    ArrayNode a = F.arrayNode();
    while (b.hasRemaining()) {
      switch (field) {
        case "logprobs" -> a.add(value(field, b.getFloat()));
        case "loss_mask" -> a.add(b.get() & 0xff);
        default -> a.add(b.getInt());
      }
    }
    return a;
  }
}

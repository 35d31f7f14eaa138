package dev.rlstream.kafbat;

import io.kafbat.ui.serde.api.DeserializeResult;
import io.kafbat.ui.serde.api.PropertyResolver;
import io.kafbat.ui.serde.api.RecordHeaders;
import io.kafbat.ui.serde.api.SchemaDescription;
import io.kafbat.ui.serde.api.Serde;
import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.file.Path;
import java.util.Map;
import java.util.Optional;

/**
 * Kafbat UI serde that shows rlstream record values (every rlstream topic: prompts, rollouts,
 * scored, control, metrics, dlq) as JSON. Read-only: it does not serialize.
 *
 * <p>Properties: {@code schemasDir} (required), the directory holding rlstream's
 * {@code <Name>.v<N>.avsc} files. Kafbat configuration, e.g. as environment variables:
 * <pre>
 * KAFKA_CLUSTERS_0_SERDE_0_NAME=rlstream
 * KAFKA_CLUSTERS_0_SERDE_0_FILEPATH=/opt/rlstream-serde            (this jar and its dependencies)
 * KAFKA_CLUSTERS_0_SERDE_0_CLASSNAME=dev.rlstream.kafbat.RlstreamSerde
 * KAFKA_CLUSTERS_0_SERDE_0_PROPERTIES_SCHEMASDIR=/opt/rlstream-schemas
 * KAFKA_CLUSTERS_0_SERDE_0_TOPICVALUESPATTERN=(.+\.)?(prompts|rollouts|scored|control|metrics|dlq)
 * </pre>
 */
public class RlstreamSerde implements Serde {
  private volatile SchemaSet schemas;
  private Path dir;

  @Override
  public void configure(PropertyResolver serdeProperties, PropertyResolver cluster, PropertyResolver global) {
    String d = serdeProperties.getProperty("schemasDir", String.class)
        .orElseThrow(() -> new IllegalArgumentException(
            "rlstream serde: set properties.schemasDir to the directory with rlstream's .avsc files"));
    configure(Path.of(d));
  }

  /** Configure without Kafbat (DecodeMain, tests). */
  public void configure(Path schemasDir) {
    try {
      dir = schemasDir;
      schemas = new SchemaSet(schemasDir);
    } catch (IOException e) {
      throw new UncheckedIOException("rlstream serde: cannot load schemas from " + schemasDir, e);
    }
  }

  @Override
  public Optional<String> getDescription() {
    return Optional.of("rlstream records (Avro single-object encoding) decoded with the schemas in `" + dir + "`");
  }

  @Override
  public Optional<SchemaDescription> getSchema(String topic, Target type) {
    return Optional.empty();
  }

  @Override
  public boolean canDeserialize(String topic, Target type) {
    return type == Target.VALUE;
  }

  @Override
  public boolean canSerialize(String topic, Target type) {
    return false;
  }

  @Override
  public Serializer serializer(String topic, Target type) {
    throw new UnsupportedOperationException("the rlstream serde is read-only");
  }

  @Override
  public Deserializer deserializer(String topic, Target type) {
    SchemaSet s = schemas;
    return (RecordHeaders headers, byte[] data) -> {
      SchemaSet.Decoded d = s.decode(data);
      String fingerprint = String.format("%016x", Long.reverseBytes(d.writer().fingerprint())); // wire byte order
      return new DeserializeResult(
          JsonRenderer.render(d.record(), s).toString(),
          DeserializeResult.Type.JSON,
          Map.of("schema", d.writer().label(), "fingerprint", fingerprint));
    };
  }
}

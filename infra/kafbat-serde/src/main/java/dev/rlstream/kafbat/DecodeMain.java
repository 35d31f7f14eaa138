package dev.rlstream.kafbat;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.kafbat.ui.serde.api.DeserializeResult;
import io.kafbat.ui.serde.api.PropertyResolver;
import io.kafbat.ui.serde.api.RecordHeader;
import io.kafbat.ui.serde.api.RecordHeaders;
import io.kafbat.ui.serde.api.Serde;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.Base64;
import java.util.Collections;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.Optional;

/**
 * Decodes rlstream values outside Kafbat UI, through the same Serde API calls Kafbat makes
 * (configure, canDeserialize, deserializer, deserialize).
 *
 * <pre>
 * java -cp 'target/plugin/*:target/cli-lib/*' dev.rlstream.kafbat.DecodeMain SCHEMAS_DIR [TOPIC] &lt; values.b64
 * </pre>
 * Each stdin line is one value in base64; each stdout line is
 * {@code {"schema": "Trajectory.v1", "fingerprint": "...", "value": {...}}} or {@code {"error": "..."}}.
 */
public final class DecodeMain {
  private DecodeMain() {}

  public static void main(String[] args) throws Exception {
    if (args.length < 1) {
      System.err.println("usage: DecodeMain SCHEMAS_DIR [TOPIC] < base64-lines");
      System.exit(2);
    }
    String topic = args.length > 1 ? args[1] : "rl.rollouts";
    Serde serde = new RlstreamSerde();
    PropertyResolver none = new MapResolver(Map.of());
    serde.configure(new MapResolver(Map.of("schemasDir", args[0])), none, none);
    if (!serde.canDeserialize(topic, Serde.Target.VALUE)) {
      throw new IllegalStateException("serde refuses values of " + topic);
    }
    Serde.Deserializer deserializer = serde.deserializer(topic, Serde.Target.VALUE);
    ObjectMapper json = new ObjectMapper();
    RecordHeaders noHeaders = new RecordHeaders() {
      @Override
      public Iterator<RecordHeader> iterator() {
        return Collections.emptyIterator();
      }
    };
    var in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.US_ASCII));
    for (String line = in.readLine(); line != null; line = in.readLine()) {
      if (line.isBlank()) {
        continue;
      }
      ObjectNode out = json.createObjectNode();
      try {
        DeserializeResult r = deserializer.deserialize(noHeaders, Base64.getDecoder().decode(line.strip()));
        r.getAdditionalProperties().forEach((k, v) -> out.put(k, v.toString()));
        out.put("type", r.getType().name());
        out.set("value", json.readTree(r.getResult()));
      } catch (RuntimeException e) {
        out.put("error", e.getMessage());
      }
      System.out.println(out);
    }
  }

  /** A flat map as Kafbat's property resolver (only simple values). */
  private record MapResolver(Map<String, String> props) implements PropertyResolver {
    @Override
    public <T> Optional<T> getProperty(String key, Class<T> targetType) {
      return Optional.ofNullable(props.get(key)).map(targetType::cast);
    }

    @Override
    public <T> Optional<List<T>> getListProperty(String key, Class<T> itemType) {
      return Optional.empty();
    }

    @Override
    public <K, V> Optional<Map<K, V>> getMapProperty(String key, Class<K> keyType, Class<V> valueType) {
      return Optional.empty();
    }
  }
}

package dev.postal.interop;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.cloudevents.CloudEvent;
import io.cloudevents.core.builder.CloudEventBuilder;
import io.cloudevents.jackson.JsonFormat;
import io.cloudevents.kafka.CloudEventSerializer;
import io.cloudevents.core.message.Encoding;
import java.net.URI;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.util.Iterator;
import java.util.Map;
import java.util.Properties;
import org.apache.kafka.clients.producer.KafkaProducer;
import org.apache.kafka.clients.producer.ProducerConfig;
import org.apache.kafka.clients.producer.ProducerRecord;
import org.apache.kafka.clients.producer.RecordMetadata;
import org.apache.kafka.common.serialization.StringSerializer;

/**
 * Produces CloudEvents with kafka-clients' {@link KafkaProducer} and the CloudEvents SDK's
 * {@link CloudEventSerializer}, as a Java service would: binary content mode (the default), or
 * structured mode ({@code application/cloudevents+json}) for events that ask for it. The
 * record key is the event's key; the partition is the one kafka-clients' default partitioner
 * picks for it.
 *
 * <p>Usage: {@code ProduceCloudEvents <bootstrap> <topic> <events.jsonl>}. Each input line is
 * a JSON object: {@code id}, {@code type}, {@code key}, {@code data} (any JSON, sent as
 * {@code application/json}), and optionally {@code source} (default {@code /java-interop}),
 * {@code time} (RFC 3339; default now), {@code mode} ({@code binary} or {@code structured})
 * and {@code extensions} (name to string or integer). Events are sent one at a time, in file
 * order, each acknowledged ({@code acks=all}, idempotent producer) before the next; one JSON
 * line per event is printed: id, key, mode, partition, offset.
 */
public final class ProduceCloudEvents {
    private ProduceCloudEvents() {}

    private static KafkaProducer<String, CloudEvent> producer(String bootstrap, Encoding encoding) {
        Properties props = new Properties();
        props.put(ProducerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ProducerConfig.KEY_SERIALIZER_CLASS_CONFIG, StringSerializer.class);
        props.put(ProducerConfig.VALUE_SERIALIZER_CLASS_CONFIG, CloudEventSerializer.class);
        props.put(ProducerConfig.ACKS_CONFIG, "all");
        props.put(ProducerConfig.ENABLE_IDEMPOTENCE_CONFIG, true);
        props.put(ProducerConfig.CLIENT_ID_CONFIG, "postal-interop-producer-" + encoding);
        // A missing topic fails the send within 20 s instead of the default 60.
        props.put(ProducerConfig.MAX_BLOCK_MS_CONFIG, 20_000);
        props.put(CloudEventSerializer.ENCODING_CONFIG, encoding);
        if (encoding == Encoding.STRUCTURED) {
            props.put(CloudEventSerializer.EVENT_FORMAT_CONFIG, JsonFormat.CONTENT_TYPE);
        }
        return new KafkaProducer<>(props);
    }

    public static void main(String[] args) throws Exception {
        // JSON lines in UTF-8 whatever the locale (under LANG unset, Java 17 writes '?' for
        // every non-ASCII character).
        System.setOut(new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8));
        System.setErr(new PrintStream(new FileOutputStream(FileDescriptor.err), true, StandardCharsets.UTF_8));
        if (args.length != 3) {
            System.err.println("usage: ProduceCloudEvents <bootstrap> <topic> <events.jsonl>");
            System.exit(64);
        }
        String bootstrap = args[0];
        String topic = args[1];
        ObjectMapper json = new ObjectMapper();
        try (KafkaProducer<String, CloudEvent> binary = producer(bootstrap, Encoding.BINARY);
                KafkaProducer<String, CloudEvent> structured =
                        producer(bootstrap, Encoding.STRUCTURED)) {
            for (String raw : Files.readAllLines(Path.of(args[2]), StandardCharsets.UTF_8)) {
                if (raw.isBlank()) {
                    continue;
                }
                JsonNode in = json.readTree(raw);
                String key = in.get("key").asText();
                CloudEventBuilder b = CloudEventBuilder.v1()
                        .withId(in.get("id").asText())
                        .withType(in.get("type").asText())
                        .withSource(URI.create(in.path("source").asText("/java-interop")))
                        .withSubject(key)
                        .withTime(in.has("time")
                                ? OffsetDateTime.parse(in.get("time").asText())
                                : OffsetDateTime.now(ZoneOffset.UTC))
                        .withDataContentType("application/json")
                        .withData(json.writeValueAsBytes(in.get("data")));
                Iterator<Map.Entry<String, JsonNode>> ext = in.path("extensions").fields();
                while (ext.hasNext()) {
                    Map.Entry<String, JsonNode> x = ext.next();
                    if (x.getValue().isInt()) {
                        b.withExtension(x.getKey(), x.getValue().intValue());
                    } else {
                        b.withExtension(x.getKey(), x.getValue().asText());
                    }
                }
                String mode = in.path("mode").asText("binary");
                KafkaProducer<String, CloudEvent> p = switch (mode) {
                    case "binary" -> binary;
                    case "structured" -> structured;
                    default -> throw new IllegalArgumentException("mode " + mode);
                };
                RecordMetadata m = p.send(new ProducerRecord<>(topic, key, b.build())).get();
                ObjectNode out = json.createObjectNode();
                out.put("id", in.get("id").asText());
                out.put("key", key);
                out.put("mode", mode);
                out.put("partition", m.partition());
                out.put("offset", m.offset());
                System.out.println(json.writeValueAsString(out));
            }
        }
        System.out.flush();
    }
}

package dev.postal.interop;

import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.node.ObjectNode;
import io.cloudevents.CloudEvent;
import io.cloudevents.kafka.CloudEventDeserializer;
import java.io.FileDescriptor;
import java.io.FileOutputStream;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Base64;
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.consumer.ConsumerConfig;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.apache.kafka.clients.consumer.KafkaConsumer;
import org.apache.kafka.clients.producer.internals.BuiltInPartitioner;
import org.apache.kafka.common.PartitionInfo;
import org.apache.kafka.common.TopicPartition;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;

/**
 * Reads every record of a topic from the beginning (no consumer group: all partitions
 * assigned) with kafka-clients' {@link KafkaConsumer} and the CloudEvents SDK's
 * {@link CloudEventDeserializer} (Kafka protocol binding), and prints one JSON line per event.
 *
 * <p>Each line also carries {@code java_partition}: the partition kafka-clients' own producer
 * picks for the record's key ({@link BuiltInPartitioner#partitionForKey}, murmur2 over the key
 * bytes), and {@code partition_matches}. A last line {@code {"summary": ...}} counts the
 * records and the mismatches.
 *
 * <p>Usage: {@code ConsumeCloudEvents <bootstrap> <topic> <records> [timeout-seconds]}. Exits 0
 * after {@code records} records, 2 if they did not all arrive in time, 1 on any error,
 * including a record the SDK refuses to decode (the exception is printed).
 */
public final class ConsumeCloudEvents {
    private ConsumeCloudEvents() {}

    public static void main(String[] args) throws Exception {
        // JSON lines in UTF-8 whatever the locale (under LANG unset, Java 17 writes '?' for
        // every non-ASCII character).
        System.setOut(new PrintStream(new FileOutputStream(FileDescriptor.out), true, StandardCharsets.UTF_8));
        System.setErr(new PrintStream(new FileOutputStream(FileDescriptor.err), true, StandardCharsets.UTF_8));
        if (args.length < 3) {
            System.err.println(
                    "usage: ConsumeCloudEvents <bootstrap> <topic> <records> [timeout-seconds]");
            System.exit(64);
        }
        String bootstrap = args[0];
        String topic = args[1];
        long want = Long.parseLong(args[2]);
        long timeoutSecs = args.length > 3 ? Long.parseLong(args[3]) : 60;
        Instant deadline = Instant.now().plusSeconds(timeoutSecs);

        Properties props = new Properties();
        props.put(ConsumerConfig.BOOTSTRAP_SERVERS_CONFIG, bootstrap);
        props.put(ConsumerConfig.KEY_DESERIALIZER_CLASS_CONFIG, ByteArrayDeserializer.class);
        props.put(ConsumerConfig.VALUE_DESERIALIZER_CLASS_CONFIG, CloudEventDeserializer.class);
        props.put(ConsumerConfig.ENABLE_AUTO_COMMIT_CONFIG, false);
        props.put(ConsumerConfig.ISOLATION_LEVEL_CONFIG, "read_committed");
        props.put(ConsumerConfig.CLIENT_ID_CONFIG, "postal-interop-consumer");

        ObjectMapper json = new ObjectMapper();
        long seen = 0;
        long mismatches = 0;
        try (KafkaConsumer<byte[], CloudEvent> consumer = new KafkaConsumer<>(props)) {
            List<PartitionInfo> infos = consumer.partitionsFor(topic, Duration.ofSeconds(30));
            if (infos == null || infos.isEmpty()) {
                throw new IllegalStateException("topic " + topic + " has no partitions");
            }
            int partitions = infos.size();
            List<TopicPartition> all = new ArrayList<>();
            for (PartitionInfo p : infos) {
                all.add(new TopicPartition(topic, p.partition()));
            }
            consumer.assign(all);
            consumer.seekToBeginning(all);
            while (seen < want) {
                if (Instant.now().isAfter(deadline)) {
                    System.err.printf(
                            "ConsumeCloudEvents: %d of %d records within %d s%n",
                            seen, want, timeoutSecs);
                    System.out.flush();
                    System.exit(2);
                }
                for (ConsumerRecord<byte[], CloudEvent> r : consumer.poll(Duration.ofMillis(200))) {
                    CloudEvent e = r.value();
                    if (e == null) {
                        throw new IllegalStateException(
                                "record " + r.partition() + "@" + r.offset() + " has no value");
                    }
                    ObjectNode line = json.createObjectNode();
                    line.put("id", e.getId());
                    line.put("type", e.getType());
                    line.put("source", e.getSource().toString());
                    line.put("specversion", e.getSpecVersion().toString());
                    line.put("subject", e.getSubject());
                    line.put("time", e.getTime() == null ? null : e.getTime().toString());
                    line.put("datacontenttype", e.getDataContentType());
                    line.put("key", r.key() == null ? null
                            : new String(r.key(), StandardCharsets.UTF_8));
                    line.put("partition", r.partition());
                    line.put("offset", r.offset());
                    byte[] data = e.getData() == null ? null : e.getData().toBytes();
                    String ct = e.getDataContentType();
                    if (data == null) {
                        line.putNull("data");
                    } else if (ct != null && ct.startsWith("application/json")) {
                        // Fails (exit 1) if a record says JSON and is not.
                        line.set("data", json.readTree(data));
                    } else {
                        line.put("data_base64", Base64.getEncoder().encodeToString(data));
                    }
                    ObjectNode ext = line.putObject("extensions");
                    for (String name : e.getExtensionNames()) {
                        Object v = e.getExtension(name);
                        ext.put(name, v == null ? null : v.toString());
                    }
                    if (r.key() != null) {
                        int javaPartition = BuiltInPartitioner.partitionForKey(r.key(), partitions);
                        line.put("java_partition", javaPartition);
                        boolean same = javaPartition == r.partition();
                        line.put("partition_matches", same);
                        if (!same) {
                            mismatches++;
                        }
                    }
                    System.out.println(json.writeValueAsString(line));
                    seen++;
                }
            }
        }
        ObjectNode summary = json.createObjectNode();
        ObjectNode s = summary.putObject("summary");
        s.put("records", seen);
        s.put("partition_mismatches", mismatches);
        System.out.println(json.writeValueAsString(summary));
        System.out.flush();
    }
}

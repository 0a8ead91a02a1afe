// RocketMQ's own Java client as an independent producer and consumer, for conformance tests and
// for the broker's intake ceiling in the benchmarks. Compiled and run by forwarder/java_client.py
// against the same Maven jars as the local broker; nothing of timewheel is on its class path.
//
//   produce  --namesrv A [--group G] [--compress zlib|lz4|zstd|none] [--compress-over N] [--as-batch true]
//            [--resend-after-ms M] [--ak K --sk S]
//                                 one JSON message a line on stdin: {"topic","tags","keys","body" (base64),
//                                 "props":{...}}; prints {"ok":true,"msgId":..} or {"ok":false,"error":..} each;
//                                 with M, each message is sent again M ms later, as the client's own retry of a
//                                 send sends it (the same UNIQ_KEY, born again), and that send is reported too
//                                 (lz4 and zstd need RocketMQ 5's client: 4.9's producer compresses with zlib)
//   consume  --namesrv A --topic T --group G --count N --timeout-ms M [--ak K --sk S]
//                                 prints each message received as JSON, then {"done":true,"received":n}
//   intake   --namesrv A --topic T --seconds S --threads N --batch B --body-size Z [--props JSON] [--ak K --sk S]
//                                 prints {"sent":n,"seconds":s,"rate":r}
//   pace     --namesrv A --topic T --rate R --seconds S --id-start N [--warm-up-seconds W] [--threads N]
//            [--body-size Z] [--target T --delay-min-ms A --delay-max-ms B] [--seed S] [--ak K --sk S]
//                                 messages at a steady rate (small batches from several threads), each with
//                                 BENCH_ID and BENCH_DUE_MS: with --target, delay messages of timewheel's contract
//                                 due a uniformly random delay later; without, plain messages whose "due" time is
//                                 their send time (µs precision); the first W seconds' messages (numbered from
//                                 id-start too) warm the path up and are counted apart; prints {"sent":n (after the
//                                 warm-up),"warm_up_sent":w,"failed":f,"seconds":s,"rate":r (all sent / s)}
//   lateness --namesrv A --topic T --group G --id-min N --id-max M [--count C] [--wait-ms W] [--idle-ms I]
//            [--threads N] [--ak K --sk S]
//                                 RocketMQ's push consumer, a fresh group from the first offset: prints
//                                 {"ready":true,"queues":q} once it holds every queue of the topic; a number on
//                                 stdin (EOF: --count) is how many distinct BENCH_IDs in [id-min, id-max) to wait
//                                 for (at most --wait-ms from then, giving up after --idle-ms without one); each
//                                 one's lateness is its receive time (µs precision) − BENCH_DUE_MS; prints
//                                 {"received","expected","duplicates","other","quantiles_ms":[1001, 0..100 %],
//                                 "by_second":[[n, p50, p99, max] a second of receive time]}
//   noop     --namesrv A --topic T --group G --count N [--batch B] [--timeout-ms M] [--idle-ms I] [--ak K --sk S]
//                                 RocketMQ's lite pull consumer reading a backlog from the first offset and doing
//                                 nothing with it; prints {"received":n,"seconds":s,"rate":r} (first to last message)
//   sign                          one JSON request a line on stdin: {"fields":{...},"body" (base64),"ak","sk"};
//                                 prints the ext fields AclClientRPCHook sends for it
import com.alibaba.fastjson.JSON;
import com.alibaba.fastjson.JSONObject;
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Base64;
import java.util.BitSet;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicReference;
import org.apache.rocketmq.acl.common.AclClientRPCHook;
import org.apache.rocketmq.acl.common.SessionCredentials;
import org.apache.rocketmq.client.consumer.DefaultLitePullConsumer;
import org.apache.rocketmq.client.consumer.DefaultMQPushConsumer;
import org.apache.rocketmq.client.consumer.listener.ConsumeConcurrentlyStatus;
import org.apache.rocketmq.client.consumer.listener.MessageListenerConcurrently;
import org.apache.rocketmq.client.consumer.rebalance.AllocateMessageQueueAveragely;
import org.apache.rocketmq.client.producer.DefaultMQProducer;
import org.apache.rocketmq.client.producer.SendResult;
import org.apache.rocketmq.common.consumer.ConsumeFromWhere;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;
import org.apache.rocketmq.remoting.RPCHook;
import org.apache.rocketmq.remoting.protocol.RemotingCommand;

public final class JavaClient {
    private JavaClient() {
    }

    public static void main(String[] args) throws Exception {
        Map<String, String> opt = new HashMap<>();
        for (int i = 1; i + 1 < args.length; i += 2) {
            opt.put(args[i].replaceFirst("^--", ""), args[i + 1]);
        }
        try {
            switch (args.length > 0 ? args[0] : "") {
                case "produce": produce(opt); break;
                case "consume": consume(opt); break;
                case "intake": intake(opt); break;
                case "pace": pace(opt); break;
                case "lateness": lateness(opt); break;
                case "noop": noop(opt); break;
                case "sign": sign(); break;
                default:
                    System.err.println("usage: JavaClient produce|consume|intake|pace|lateness|noop|sign --namesrv HOST:PORT ...");
                    System.exit(2);
            }
        } catch (Exception e) {
            e.printStackTrace();
            System.exit(1);  // the client's own threads would keep the JVM alive
        }
        System.exit(0);
    }

    private static RPCHook hook(Map<String, String> opt) {
        String ak = opt.get("ak");
        return ak == null ? null : new AclClientRPCHook(new SessionCredentials(ak, opt.getOrDefault("sk", "")));
    }

    private static DefaultMQProducer producer(Map<String, String> opt) throws Exception {
        // with --trace true the client writes RocketMQ's message trace (to --trace-topic, else RMQ_SYS_TRACE_TOPIC)
        boolean trace = opt.getOrDefault("trace", "false").equals("true");
        DefaultMQProducer p = new DefaultMQProducer(opt.getOrDefault("group", "java-conformance-producer"), hook(opt),
                                                    trace, opt.get("trace-topic"));
        p.setNamesrvAddr(opt.get("namesrv"));
        p.setInstanceName("java-" + ProcessHandle.current().pid());
        p.setSendMsgTimeout(30_000);  // a JVM starting cold on a loaded machine (TLS set-up included) is slow
        String codec = opt.getOrDefault("compress", "zlib");
        if (codec.equals("none")) {
            p.setCompressMsgBodyOverHowmuch(Integer.MAX_VALUE);
        } else {
            compressWith(p, codec);
            p.setCompressMsgBodyOverHowmuch(Integer.parseInt(opt.getOrDefault("compress-over", "4096")));
        }
        p.start();
        return p;
    }

    // The codec setter is RocketMQ 5's (setCompressType(CompressionType)); 4.9's producer has none and
    // compresses with zlib. Looked up by name, so that the harness compiles against either version's jars.
    private static void compressWith(DefaultMQProducer p, String codec) throws Exception {
        Method set = null;
        for (Method m : DefaultMQProducer.class.getMethods()) {
            if (m.getName().equals("setCompressType") && m.getParameterCount() == 1) {
                set = m;
            }
        }
        if (set == null) {
            if (!codec.equalsIgnoreCase("zlib")) {
                throw new IllegalArgumentException("--compress " + codec + ": this RocketMQ client's producer has no "
                        + "setCompressType (RocketMQ 5's has), it compresses with zlib only");
            }
            return;
        }
        try {
            Object type = set.getParameterTypes()[0].getMethod("of", String.class).invoke(null, codec.toUpperCase());
            set.invoke(p, type);
        } catch (InvocationTargetException e) {
            // the client's own error (an unknown codec's name), as the direct call threw it
            throw e.getCause() instanceof Exception ? (Exception) e.getCause() : e;
        }
    }

    private static Message toMessage(JSONObject j) {
        byte[] body = Base64.getDecoder().decode(j.getString("body") == null ? "" : j.getString("body"));
        Message m = new Message(j.getString("topic"), body);
        if (j.getString("tags") != null) {
            m.setTags(j.getString("tags"));
        }
        if (j.getString("keys") != null) {
            m.setKeys(j.getString("keys"));
        }
        JSONObject props = j.getJSONObject("props");
        if (props != null) {
            for (String k : props.keySet()) {
                m.putUserProperty(k, props.getString(k));
            }
        }
        return m;
    }

    private static void produce(Map<String, String> opt) throws Exception {
        DefaultMQProducer p = producer(opt);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        List<Message> pending = new ArrayList<>();
        boolean batch = opt.getOrDefault("as-batch", "false").equals("true");
        long resendAfterMs = Long.parseLong(opt.getOrDefault("resend-after-ms", "-1"));
        List<String> sent = new ArrayList<>();
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) {
                continue;
            }
            Message m = toMessage(JSON.parseObject(line));
            if (batch) {
                pending.add(m);
            } else {
                sent.addAll(report(() -> p.send(m), 1));
                if (resendAfterMs >= 0) {
                    Thread.sleep(resendAfterMs);
                    sent.addAll(report(() -> p.send(m), 1));
                }
            }
        }
        if (batch && !pending.isEmpty()) {
            sent.addAll(report(() -> p.send(pending), pending.size()));
        }
        if (opt.getOrDefault("trace", "false").equals("true")) {
            awaitTraces(p, opt.getOrDefault("trace-topic", "RMQ_SYS_TRACE_TOPIC"), p.getProducerGroup(), sent);
        }
        p.shutdown();
    }

    // The trace records go out asynchronously from a separate client, and shutdown() waits only 500 ms for
    // them before stopping it: a cold JVM on a loaded machine lost the producer's own record that way, even
    // after a fixed 3 s pause. So wait (at most 60 s) until the broker holds this producer's Pub record of
    // every message sent, looked up the way queryMsgTraceById does (the trace topic's key index).
    private static void awaitTraces(DefaultMQProducer p, String traceTopic, String group, List<String> msgIds)
            throws InterruptedException {
        String pub = "Pub\u0001";
        String ofGroup = "\u0001" + group + "\u0001";
        long deadline = System.currentTimeMillis() + 60_000;
        List<String> waiting = new ArrayList<>(msgIds);
        while (!waiting.isEmpty() && System.currentTimeMillis() < deadline) {
            waiting.removeIf(id -> {
                try {
                    for (MessageExt m : p.queryMessage(traceTopic, id, 32, 0, Long.MAX_VALUE).getMessageList()) {
                        String body = new String(m.getBody(), StandardCharsets.UTF_8);
                        if (body.contains(pub) && body.contains(ofGroup) && body.contains(id)) {
                            return true;
                        }
                    }
                } catch (Exception notYet) {
                    // the broker answers "no message" until the record is indexed; asked again below
                }
                return false;
            });
            if (!waiting.isEmpty()) {
                Thread.sleep(200);
            }
        }
        if (!waiting.isEmpty()) {
            System.err.println("trace records not seen in " + traceTopic + " after 60 s for " + waiting);
        }
    }

    private interface Send {
        SendResult call() throws Exception;
    }

    // prints the outcome of one send; returns the ids it stored (a batch's are joined by commas)
    private static List<String> report(Send send, int n) {
        JSONObject out = new JSONObject();
        List<String> ids = new ArrayList<>();
        try {
            SendResult r = send.call();
            boolean ok = r.getSendStatus().name().equals("SEND_OK");
            out.put("ok", ok);
            out.put("status", r.getSendStatus().name());
            out.put("msgId", r.getMsgId());
            out.put("count", n);
            if (ok && r.getMsgId() != null) {
                ids.addAll(Arrays.asList(r.getMsgId().split(",")));
            }
        } catch (Exception e) {
            out.put("ok", false);
            out.put("error", e.getClass().getSimpleName() + ": " + e.getMessage());
            out.put("count", n);
        }
        System.out.println(out.toJSONString());
        System.out.flush();
        return ids;
    }

    private static void consume(Map<String, String> opt) throws Exception {
        DefaultLitePullConsumer c = new DefaultLitePullConsumer(opt.getOrDefault("group", "java-conformance-consumer"),
                hook(opt));
        c.setNamesrvAddr(opt.get("namesrv"));
        c.setInstanceName("java-" + ProcessHandle.current().pid());
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.subscribe(opt.get("topic"), "*");
        c.start();
        long want = Long.parseLong(opt.getOrDefault("count", "1"));
        long deadline = System.currentTimeMillis() + Long.parseLong(opt.getOrDefault("timeout-ms", "60000"));
        long got = 0;
        while (got < want && System.currentTimeMillis() < deadline) {
            for (MessageExt m : c.poll(500)) {
                JSONObject out = new JSONObject();
                out.put("topic", m.getTopic());
                out.put("tags", m.getTags());
                out.put("keys", m.getKeys());
                out.put("body", Base64.getEncoder().encodeToString(m.getBody()));
                out.put("props", m.getProperties());
                out.put("msgId", m.getMsgId());
                out.put("queueId", m.getQueueId());
                out.put("queueOffset", m.getQueueOffset());
                out.put("storeTimestamp", m.getStoreTimestamp());
                out.put("receivedMs", System.currentTimeMillis());
                System.out.println(out.toJSONString());
                got++;
            }
            System.out.flush();
        }
        JSONObject done = new JSONObject();
        done.put("done", true);
        done.put("received", got);
        System.out.println(done.toJSONString());
        c.shutdown();
    }

    private static void sign() throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        String line;
        while ((line = in.readLine()) != null) {
            if (line.isBlank()) {
                continue;
            }
            JSONObject j = JSON.parseObject(line);
            RemotingCommand req = RemotingCommand.createRequestCommand(310, null);
            HashMap<String, String> ext = new HashMap<>();
            JSONObject fields = j.getJSONObject("fields");
            for (String k : fields.keySet()) {
                ext.put(k, fields.getString(k));
            }
            req.setExtFields(ext);
            req.setBody(Base64.getDecoder().decode(j.getString("body")));
            new AclClientRPCHook(new SessionCredentials(j.getString("ak"), j.getString("sk"))).doBeforeRequest("", req);
            System.out.println(JSON.toJSONString(req.getExtFields()));
        }
    }

    private static void intake(Map<String, String> opt) throws Exception {
        opt.putIfAbsent("compress", "none");
        DefaultMQProducer p = producer(opt);
        String topic = opt.get("topic");
        int threads = Integer.parseInt(opt.getOrDefault("threads", "4"));
        int batch = Integer.parseInt(opt.getOrDefault("batch", "128"));
        byte[] body = new byte[Integer.parseInt(opt.getOrDefault("body-size", "100"))];
        long seconds = Long.parseLong(opt.getOrDefault("seconds", "10"));
        JSONObject props = JSON.parseObject(opt.getOrDefault("props", "{}"));
        AtomicLong sent = new AtomicLong();
        long start = System.nanoTime();
        long end = start + seconds * 1_000_000_000L;
        List<Thread> workers = new ArrayList<>();
        for (int t = 0; t < threads; t++) {
            Thread w = new Thread(() -> {
                while (System.nanoTime() < end) {
                    // New messages each time: a message object keeps the unique id it was first sent with.
                    List<Message> msgs = new ArrayList<>(batch);
                    for (int i = 0; i < batch; i++) {
                        Message m = new Message(topic, body);
                        for (String k : props.keySet()) {
                            m.putUserProperty(k, props.getString(k));
                        }
                        msgs.add(m);
                    }
                    try {
                        p.send(msgs);
                        sent.addAndGet(batch);
                    } catch (Exception e) {
                        // a busy broker: count only what it stored
                    }
                }
            });
            w.start();
            workers.add(w);
        }
        for (Thread w : workers) {
            w.join();
        }
        double took = (System.nanoTime() - start) / 1e9;
        JSONObject out = new JSONObject();
        out.put("sent", sent.get());
        out.put("seconds", took);
        out.put("rate", sent.get() / took);
        System.out.println(out.toJSONString());
        p.shutdown();
    }

    private static void pace(Map<String, String> opt) throws Exception {
        opt.putIfAbsent("compress", "none");
        DefaultMQProducer p = producer(opt);
        String topic = opt.get("topic");
        String target = opt.get("target");
        double rate = Double.parseDouble(opt.get("rate"));
        long warm = (long) (rate * Double.parseDouble(opt.getOrDefault("warm-up-seconds", "0")));
        long total = warm + (long) (rate * Double.parseDouble(opt.get("seconds")));
        long idStart = Long.parseLong(opt.get("id-start"));
        int threads = Integer.parseInt(opt.getOrDefault("threads", "4"));
        long delayMin = Long.parseLong(opt.getOrDefault("delay-min-ms", "1000"));
        long delayMax = Long.parseLong(opt.getOrDefault("delay-max-ms", "10000"));
        byte[] body = new byte[Integer.parseInt(opt.getOrDefault("body-size", "100"))];
        long seed = Long.parseLong(opt.getOrDefault("seed", "7"));
        AtomicLong sent = new AtomicLong();
        AtomicLong warmSent = new AtomicLong();
        AtomicLong failed = new AtomicLong();
        long start = System.nanoTime();
        List<Thread> workers = new ArrayList<>();
        for (int t = 0; t < threads; t++) {
            final int me = t;
            Thread w = new Thread(() -> {
                java.util.Random rnd = new java.util.Random(seed + me);
                long next = me;  // this thread sends message numbers me, me + threads, ...
                while (next < total) {
                    long due = (long) ((System.nanoTime() - start) / 1e9 * rate);
                    List<Message> batch = new ArrayList<>();
                    long warmInBatch = 0;
                    while (next < total && next <= due && batch.size() < 32) {
                        warmInBatch += next < warm ? 1 : 0;
                        Message m = new Message(topic, body);
                        m.putUserProperty("BENCH_ID", Long.toString(idStart + next));
                        if (target != null) {
                            long at = System.currentTimeMillis() + delayMin
                                + (delayMax > delayMin ? (long) (rnd.nextDouble() * (delayMax - delayMin + 1)) : 0);
                            m.putUserProperty("TW_TARGET_TOPIC", target);
                            m.putUserProperty("TW_DELIVER_AT_MS", Long.toString(at));
                            m.putUserProperty("BENCH_DUE_MS", Long.toString(at));
                        } else {
                            java.time.Instant now = java.time.Instant.now();
                            m.putUserProperty("BENCH_DUE_MS", String.format("%.3f",
                                now.getEpochSecond() * 1000.0 + now.getNano() / 1e6));
                        }
                        batch.add(m);
                        next += threads;
                    }
                    if (batch.isEmpty()) {
                        java.util.concurrent.locks.LockSupport.parkNanos(200_000);
                        continue;
                    }
                    try {
                        p.send(batch);
                        sent.addAndGet(batch.size() - warmInBatch);
                        warmSent.addAndGet(warmInBatch);
                    } catch (Exception e) {
                        failed.addAndGet(batch.size());
                    }
                }
            });
            w.start();
            workers.add(w);
        }
        for (Thread w : workers) {
            w.join();
        }
        double took = (System.nanoTime() - start) / 1e9;
        JSONObject out = new JSONObject();
        out.put("sent", sent.get());
        out.put("warm_up_sent", warmSent.get());
        out.put("failed", failed.get());
        out.put("seconds", took);
        out.put("rate", (sent.get() + warmSent.get()) / took);
        System.out.println(out.toJSONString());
        p.shutdown();
    }

    /** Epoch milliseconds with the clock's sub-millisecond part (the plain hop is a few ms). */
    private static double nowMs() {
        java.time.Instant now = java.time.Instant.now();
        return now.getEpochSecond() * 1000.0 + now.getNano() / 1e6;
    }

    /** Latenesses of the distinct wanted messages received, and what else arrived. */
    private static final class Arrivals {
        private final long idMin;
        private final long idMax;
        private final BitSet seen = new BitSet();
        private double[] late = new double[1 << 16];
        private double[] received = new double[1 << 16];
        private int count;
        private long duplicates;
        private long other;
        private double firstMs;
        private double lastMs;

        Arrivals(long idMin, long idMax) {
            this.idMin = idMin;
            this.idMax = idMax;
        }

        synchronized void record(MessageExt m, double receivedMs) {
            String id = m.getUserProperty("BENCH_ID");
            String due = m.getUserProperty("BENCH_DUE_MS");
            long n;
            double dueMs;
            try {
                n = id == null ? -1 : Long.parseLong(id);
                dueMs = due == null ? Double.NaN : Double.parseDouble(due);
            } catch (NumberFormatException e) {
                n = -1;
                dueMs = Double.NaN;
            }
            if (n < idMin || n >= idMax || Double.isNaN(dueMs)) {
                other++;
                return;
            }
            int bit = (int) (n - idMin);
            if (seen.get(bit)) {
                duplicates++;
                return;
            }
            seen.set(bit);
            if (count == late.length) {
                late = Arrays.copyOf(late, count * 2);
                received = Arrays.copyOf(received, count * 2);
            }
            received[count] = receivedMs;
            late[count++] = receivedMs - dueMs;
            if (count == 1) {
                firstMs = receivedMs;
            }
            lastMs = receivedMs;
        }

        synchronized int count() {
            return count;
        }

        /** 1001 quantiles (0, 0.1, ... 100 %) of all latenesses. */
        synchronized double[] quantiles() {
            return quantilesOf(Arrays.copyOf(late, count), 1000);
        }

        /** Per second of receive time from the first arrival: [messages, p50, p99, max], to tell a cold start
         *  or a backlog building up from a steady state. */
        synchronized List<List<Double>> bySecond() {
            List<List<Double>> out = new ArrayList<>();
            if (count == 0) {
                return out;
            }
            int seconds = (int) ((lastMs - firstMs) / 1000) + 1;
            int[] n = new int[seconds];
            for (int i = 0; i < count; i++) {
                n[(int) ((received[i] - firstMs) / 1000)]++;
            }
            double[][] rows = new double[seconds][];
            for (int s = 0; s < seconds; s++) {
                rows[s] = new double[n[s]];
                n[s] = 0;
            }
            for (int i = 0; i < count; i++) {
                int s = (int) ((received[i] - firstMs) / 1000);
                rows[s][n[s]++] = late[i];
            }
            for (double[] row : rows) {
                double[] q = quantilesOf(row, 100);
                out.add(q.length == 0 ? List.of(0.0)
                        : List.of((double) row.length, round2(q[50]), round2(q[99]), round2(q[100])));
            }
            return out;
        }
    }

    /** steps + 1 quantiles (0 .. 100 %) of `values` (sorted here), interpolated linearly between ranks as
     *  numpy.percentile does; none for no values. */
    private static double[] quantilesOf(double[] values, int steps) {
        Arrays.sort(values);
        int count = values.length;
        double[] q = new double[count == 0 ? 0 : steps + 1];
        for (int i = 0; i < q.length; i++) {
            double pos = (double) i * (count - 1) / steps;
            int lo = (int) Math.floor(pos);
            int hi = Math.min(lo + 1, count - 1);
            q[i] = values[lo] + (values[hi] - values[lo]) * (pos - lo);
        }
        return q;
    }

    private static double round2(double v) {
        return Math.round(v * 100) / 100.0;
    }

    private static void lateness(Map<String, String> opt) throws Exception {
        String topic = opt.get("topic");
        long idMin = Long.parseLong(opt.get("id-min"));
        long idMax = Long.parseLong(opt.get("id-max"));
        long planned = Long.parseLong(opt.getOrDefault("count", Long.toString(idMax - idMin)));
        long waitMs = Long.parseLong(opt.getOrDefault("wait-ms", "60000"));
        long idleMs = Long.parseLong(opt.getOrDefault("idle-ms", "20000"));
        int threads = Integer.parseInt(opt.getOrDefault("threads", "4"));
        Arrivals got = new Arrivals(idMin, idMax);
        // what (group, hook) means in 5.x; 4.9 has only the constructor with the allocation strategy
        DefaultMQPushConsumer c = new DefaultMQPushConsumer(opt.get("group"), hook(opt),
                                                            new AllocateMessageQueueAveragely());
        c.setNamesrvAddr(opt.get("namesrv"));
        c.setInstanceName("java-" + ProcessHandle.current().pid());
        // The rebalance gives the subscription a new version; until a heartbeat tells the broker,
        // it answers every pull SUBSCRIPTION_NOT_LATEST. With the default 30 s heartbeat that held
        // this consumer up to ~20 s in some runs (the broker's log: one warning a queue a second).
        c.setHeartbeatBrokerInterval(1000);
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        c.setConsumeThreadMin(threads);
        c.setConsumeThreadMax(threads);
        c.subscribe(topic, "*");
        c.registerMessageListener((MessageListenerConcurrently) (msgs, ctx) -> {
            for (MessageExt m : msgs) {
                got.record(m, nowMs());
            }
            return ConsumeConcurrentlyStatus.CONSUME_SUCCESS;
        });
        c.start();
        int queues = c.fetchSubscribeMessageQueues(topic).size();
        long readyBy = System.currentTimeMillis() + 60_000;
        // the queues are this consumer's (and their pull requests under way) once the rebalance put them here
        while (c.getDefaultMQPushConsumerImpl().getRebalanceImpl().getProcessQueueTable().size() < queues) {
            if (System.currentTimeMillis() > readyBy) {
                throw new IllegalStateException("the consumer was not given the topic's " + queues + " queues in 60 s");
            }
            Thread.sleep(20);
        }
        JSONObject ready = new JSONObject();
        ready.put("ready", true);
        ready.put("queues", queues);
        System.out.println(ready.toJSONString());
        System.out.flush();

        AtomicReference<Long> expected = new AtomicReference<>();
        AtomicLong expectedAt = new AtomicLong();
        Thread control = new Thread(() -> {
            long want = planned;
            try {
                BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
                String line;
                while ((line = in.readLine()) != null) {
                    if (!line.isBlank()) {
                        want = Long.parseLong(line.trim());
                        break;
                    }
                }
            } catch (Exception e) {
                // a closed or broken stdin means the planned count
            }
            expectedAt.set(System.currentTimeMillis());
            expected.set(want);
        });
        control.setDaemon(true);
        control.start();
        int lastCount = -1;
        long lastChange = System.currentTimeMillis();
        boolean complete = false;
        while (true) {
            Thread.sleep(20);
            long now = System.currentTimeMillis();
            int n = got.count();
            if (n != lastCount) {
                lastCount = n;
                lastChange = now;
            }
            Long want = expected.get();
            if (want == null) {
                continue;
            }
            if (n >= want) {
                complete = true;
                break;
            }
            long since = expectedAt.get();
            if (now - since > waitMs || now - Math.max(lastChange, since) > idleMs) {
                break;
            }
        }
        c.shutdown();
        JSONObject out = new JSONObject();
        synchronized (got) {
            out.put("received", got.count);
            out.put("expected", expected.get());
            out.put("complete", complete);
            out.put("duplicates", got.duplicates);
            out.put("other", got.other);
            out.put("queues", queues);
            out.put("first_ms", got.firstMs);
            out.put("last_ms", got.lastMs);
            double[] q = got.quantiles();
            List<Double> rounded = new ArrayList<>(q.length);
            for (double v : q) {
                rounded.add(round2(v));
            }
            out.put("quantiles_ms", rounded);
            out.put("by_second", got.bySecond());
        }
        System.out.println(out.toJSONString());
    }

    private static void noop(Map<String, String> opt) throws Exception {
        DefaultLitePullConsumer c = new DefaultLitePullConsumer(opt.get("group"), hook(opt));
        c.setNamesrvAddr(opt.get("namesrv"));
        c.setInstanceName("java-" + ProcessHandle.current().pid());
        c.setConsumeFromWhere(ConsumeFromWhere.CONSUME_FROM_FIRST_OFFSET);
        int batch = Integer.parseInt(opt.getOrDefault("batch", "32"));
        c.setPullBatchSize(batch);
        c.subscribe(opt.get("topic"), "*");
        long start = System.nanoTime();
        c.start();
        long want = Long.parseLong(opt.get("count"));
        long deadline = System.currentTimeMillis() + Long.parseLong(opt.getOrDefault("timeout-ms", "300000"));
        long idleNs = Long.parseLong(opt.getOrDefault("idle-ms", "10000")) * 1_000_000L;
        long got = 0;
        long firstBatch = 0;  // read before the clock starts: the rate is over the messages after it
        long first = 0;
        long last = 0;
        while (got < want && System.currentTimeMillis() < deadline) {
            List<MessageExt> msgs = c.poll(200);
            long now = System.nanoTime();
            if (msgs.isEmpty()) {
                if (got > 0 && now - last > idleNs) {
                    break;
                }
                continue;
            }
            if (got == 0) {
                first = now;
                firstBatch = msgs.size();
            }
            got += msgs.size();
            last = now;
        }
        double seconds = (last - first) / 1e9;
        JSONObject out = new JSONObject();
        out.put("received", got);
        out.put("seconds", seconds);
        out.put("rate", seconds > 0 ? (got - firstBatch) / seconds : 0.0);
        out.put("wall_seconds", (System.nanoTime() - start) / 1e9);
        out.put("batch", batch);
        System.out.println(out.toJSONString());
        c.shutdown();
    }
}

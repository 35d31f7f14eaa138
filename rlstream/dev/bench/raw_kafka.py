"""Raw Kafka figures on this machine: the local broker's cold and warm start times, and plain
confluent-kafka produce/consume throughput for 8 KB messages (messages/s and MB/s).

    python -m rlstream.dev.bench.raw_kafka [--messages 50000] [--size 8192] [--bootstrap HOST:PORT]

With --bootstrap it measures that broker and skips the start timings. Otherwise it starts a
local broker in a temporary directory (cold: fresh storage; warm: restart on the same data),
measures, and stops it by PID. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.kafka.consumer import FETCH_DEFAULTS


def measure_throughput(bootstrap: str, messages: int, size: int, partitions: int = 8) -> dict:
    topic = f"bench-raw-{os.getpid()}-{int(time.time())}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics(
        [NewTopic(topic, partitions, 1, config={"max.message.bytes": str(16 << 20)})]
    ).values():
        f.result()
    payload = os.urandom(size)
    p = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            "batch.size": 1 << 20,
            "compression.type": "none",
        }
    )
    errors = []
    t0 = time.perf_counter()
    for i in range(messages):
        while True:
            try:
                p.produce(topic, payload, key=str(i % 1000).encode(), on_delivery=lambda e, m: e and errors.append(e))
                break
            except BufferError:
                p.poll(0.01)
        if i % 1000 == 0:
            p.poll(0)
    p.flush(120)
    produce_s = time.perf_counter() - t0
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": topic,
            "enable.auto.commit": False,
            **FETCH_DEFAULTS,  # as rlstream's consumers fetch
        }
    )
    c.assign([TopicPartition(topic, q, 0) for q in range(partitions)])
    got, nbytes = 0, 0
    t0 = time.perf_counter()
    while got < messages and time.perf_counter() - t0 < 300:
        for m in c.consume(1000, 1.0):
            if m.error() is None:
                got += 1
                nbytes += len(m.value())
    consume_s = time.perf_counter() - t0
    c.close()
    for f in admin.delete_topics([topic]).values():
        f.result()
    mb = messages * size / 1e6
    return {
        "messages": messages,
        "size_bytes": size,
        "partitions": partitions,
        "delivery_errors": len(errors),
        "produce_msgs_per_s": round(messages / produce_s),
        "produce_MB_per_s": round(mb / produce_s, 1),
        "consume_msgs_per_s": round(got / consume_s),
        "consume_MB_per_s": round(nbytes / 1e6 / consume_s, 1),
        "consumed": got,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--bootstrap")
    args = ap.parse_args()
    result: dict = {}
    if args.bootstrap:
        result["throughput"] = measure_throughput(args.bootstrap, args.messages, args.size)
    else:
        from rlstream.broker import LocalBroker
        from rlstream.config import BrokerConfig

        data = tempfile.mkdtemp(prefix="rlstream-bench-broker-")
        broker = LocalBroker(BrokerConfig(port=0, data_dir=data))
        try:
            t = time.perf_counter()
            state = broker.start(progress=lambda m: None)
            result["broker_cold_start_s"] = round(time.perf_counter() - t, 2)
            broker.stop(progress=lambda m: None)
            t = time.perf_counter()
            state = broker.start(progress=lambda m: None)
            result["broker_warm_start_s"] = round(time.perf_counter() - t, 2)
            result["throughput"] = measure_throughput(state["bootstrap"], args.messages, args.size)
        finally:
            broker.stop(progress=lambda m: None)
            shutil.rmtree(data, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

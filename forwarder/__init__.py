"""Everything RocketMQ: local broker, ingest consumer, delivery sink, traffic shaping."""

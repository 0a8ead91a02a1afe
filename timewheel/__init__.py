"""timewheel: arbitrary-delay messages for Apache RocketMQ."""

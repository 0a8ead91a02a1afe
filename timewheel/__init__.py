"""timewheel: arbitrary-delay messages for Apache RocketMQ.

The in-process API: `Engine(EngineConfig(data_dir), sink).start()`, then `schedule([Message(...)])`.
"""
from timewheel.clock import Clock, ManualClock, SystemClock
from timewheel.config import EngineConfig
from timewheel.engine import Engine
from timewheel.errors import (ConfigError, DelayTooLongError, EngineStateError, InvalidMessageError, StorageError,
                              TimewheelError)
from timewheel.message import DeadLetterSink, Message, Shaper, Sink, Source
from timewheel.wheel import TimeWheel

__all__ = ["Clock", "ConfigError", "DeadLetterSink", "DelayTooLongError", "Engine", "EngineConfig",
           "EngineStateError", "InvalidMessageError", "ManualClock", "Message", "Shaper", "Sink", "Source", "StorageError",
           "SystemClock", "TimeWheel", "TimewheelError"]

"""timewheel: arbitrary-delay messages for Apache RocketMQ.

The in-process API: `Engine(EngineConfig(data_dir), sink).start()`, then `schedule([Message(...)])`;
`cancel(msg_id=...)` or `apply_cancels([CancelRequest(...)])` (kept as a tombstone for messages that
arrive later); `Engine.stats()` answers an `EngineStats`. `MessageFinder` answers "where is my message" from a data
directory (by id or key, with each message's timeline).
"""
from timewheel.cancels import CancelRequest
from timewheel.clock import Clock, ManualClock, SystemClock
from timewheel.config import EngineConfig
from timewheel.engine import Engine
from timewheel.find import Found, MessageFinder, Step, Trail
from timewheel.errors import (ConfigError, DelayTooLongError, EngineStateError, InvalidMessageError,
                              NotSendingNowError, StorageError, TimewheelError)
from timewheel.gate import NO_WATERMARK, DeliveredMark, DeliveryGate
from timewheel.lateness import LatenessSummary
from timewheel.message import (CopyCheck, CopyFinder, DeadLetterSink, EncodedScheduler, Fence, Message, RecordSink,
                               SendResults, Shaper, Sink, Source)
from timewheel.stats import EngineCounters, EngineStats
from timewheel.wheel import TimeWheel

__all__ = ["NO_WATERMARK", "CancelRequest", "Clock", "ConfigError", "CopyCheck", "CopyFinder", "DeadLetterSink",
           "DelayTooLongError", "DeliveredMark", "DeliveryGate", "EncodedScheduler", "Engine", "EngineConfig",
           "EngineCounters", "EngineStateError", "EngineStats",
           "Fence", "Found", "InvalidMessageError", "LatenessSummary", "ManualClock", "Message", "MessageFinder",
           "NotSendingNowError", "RecordSink", "SendResults",
           "Shaper", "Sink", "Source", "Step", "StorageError", "SystemClock", "TimeWheel", "TimewheelError", "Trail"]

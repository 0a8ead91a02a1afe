"""Bytes on disk: record codec, schedule-log segments, ingest log, dispatch log, meta store.

Imports nothing of the project; every other package reads and writes these bytes through here.
"""
from storage._dispatch_writer import append_dispatch, cut_dispatch_tail
from storage._leftovers import Leftover, leftovers_of
from storage._reader import RecordReader, SegmentIndex
from storage.broker_rows import (BrokerRowsError, decode_array as decode_broker_array,
                                  decode_lines as decode_broker_lines, encode_array as encode_broker_array,
                                  encode_lines as encode_broker_lines, pairs_of as broker_pairs_of,
                                  rows_of as broker_rows_of, rows_of_pairs as broker_rows_of_pairs,
                                  topics_of as broker_topics_of)
from storage.audit import CheckReport, Finding, SegmentSummary, check, record_keys, summarize, summarize_segment
from storage.dispatch import (ANSWER_DTYPE, CANCELLED, CORRUPT, DEAD_LETTERED, DELIVERED, DISPATCH_DTYPE, OUTCOME_NAMES,
                              REPLAYED, RETRIED, TERMINAL, DispatchLogRead, broker_message_id, broker_message_ids,
                              dispatch_entries,
                              encode_frame, no_answers, read_dispatch_entries_of, read_dispatch_log)
from storage.encoded import EncodedRecords
from storage.errors import (CorruptRecordError, DelayTooLongError, InvalidRecordError, MetaStoreCorruptError,
                            MetaStoreStoppedError, StorageError, SnapshotMovedError, StorageWriteError, StoreClosedError)
from storage.index import INDEX_DTYPE, read_index
from storage.ingest_log import LOCATION_DTYPE, records_holding
from storage.layout import SegmentLayout, parse_segment_name, segment_name
from storage.meta import Location, MetaStore
from storage.record_bytes import RecordBytes
from storage.record import (MAX_BODY, MAX_FIELD, MAX_PROPERTIES, Record, check_record, decode, decode_keys,
                            decode_properties, encode, encode_fields, encode_keys, encode_properties)
from storage.record_reader import FIELDS as RECORD_FIELDS, CheckedRecords, check_records
from storage.origin import LOST_QUEUE, NO_QUEUE, ORIGIN_DTYPE, QueueTable
from storage.part import trusted_index
from storage.recovery import RecoveryReport
from storage.reopen import reopen_segments
from storage.sealed import PartStager, SealedPartWriter
from storage.store import TWO_YEARS_MS, AppendResult, FlushPolicy, Origin, ScheduleStore
from storage.tombstones import ID as TOMBSTONE_ID, KEY as TOMBSTONE_KEY, Tombstone, TombstoneLog, TombstoneRead, \
    decode_frames as decode_tombstones, tombstone_log

__all__ = [
    "BrokerRowsError", "broker_pairs_of", "broker_rows_of", "broker_rows_of_pairs", "broker_topics_of",
    "decode_broker_array", "decode_broker_lines", "encode_broker_array", "encode_broker_lines",
    "ANSWER_DTYPE", "CheckedRecords", "RECORD_FIELDS", "RETRIED", "check_record", "check_records", "RecordReader", "TOMBSTONE_ID", "TOMBSTONE_KEY", "broker_message_id", "broker_message_ids",
    "decode_tombstones", "no_answers", "read_dispatch_entries_of", "records_holding", "tombstone_log",
    "AppendResult", "CANCELLED", "CORRUPT", "CheckReport", "CorruptRecordError", "DEAD_LETTERED", "DELIVERED",
    "DISPATCH_DTYPE", "DelayTooLongError", "EncodedRecords", "DispatchLogRead", "Finding", "FlushPolicy", "INDEX_DTYPE",
    "InvalidRecordError", "LOCATION_DTYPE", "Location", "MAX_BODY", "MAX_PROPERTIES", "MetaStore", "MetaStoreCorruptError",
    "MetaStoreStoppedError",
    "LOST_QUEUE", "Leftover", "NO_QUEUE", "leftovers_of",
    "ORIGIN_DTYPE", "OUTCOME_NAMES", "Origin", "QueueTable",
    "PartStager", "REPLAYED", "Record", "RecordBytes", "RecoveryReport", "ScheduleStore", "SealedPartWriter", "SegmentIndex",
    "SegmentLayout", "SegmentSummary", "SnapshotMovedError", "StorageError", "StorageWriteError", "StoreClosedError", "TERMINAL",
    "TWO_YEARS_MS", "Tombstone", "TombstoneLog", "TombstoneRead", "append_dispatch", "check", "cut_dispatch_tail", "decode", "decode_keys",
    "decode_properties", "dispatch_entries",
    "encode", "encode_fields", "encode_frame", "encode_keys", "encode_properties", "MAX_FIELD", "parse_segment_name", "read_dispatch_log", "read_index", "record_keys", "reopen_segments", "segment_name",
    "summarize", "summarize_segment", "trusted_index",
]

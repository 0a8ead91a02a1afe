"""Bytes on disk: record codec, schedule-log segments, ingest log, dispatch log, meta store."""

"""PySpark jobs over the segment files: data source, backfill, audit, replay, export."""

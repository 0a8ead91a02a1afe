"""PySpark jobs over the segment files: data sources, backfill, audit, replay, export.

    from spark.session import get_session
    spark = get_session("local[*]")        # registers the three formats
    spark.read.format("timewheel").load(DATA_DIR)            # one row per record (spark.schema.RECORDS)
    spark.read.format("timewheel_dispatch").load(DATA_DIR)   # one row per dispatch entry (spark.schema.DISPATCH)
    spark.read.format("timewheel_audit").option("now_ms", NOW).load(DATA_DIR)  # the audit's cells

Modules: `source`, `dispatch_source` and `audit_source` (the formats; `source` also holds the
backfill writer), `_codec` (part files to Arrow, and Arrow rows into `storage.PartStager`), `_cells` (the
audit's per-record work, numpy only), `backfill`, `audit`,
`replay`, `export` (jobs: `DataFrame -> DataFrame` functions plus one function doing the I/O),
`session`, `progress`. The byte layouts come from `storage`, and so does every write and fsync of
a part or dispatch log; nothing here redefines one.
"""

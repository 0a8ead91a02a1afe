"""PySpark jobs over the segment files: data sources, backfill, audit, replay, export.

    from spark.session import get_session
    spark = get_session("local[*]")        # registers both formats
    spark.read.format("timewheel").load(DATA_DIR)            # one row per record (spark.schema.RECORDS)
    spark.read.format("timewheel_dispatch").load(DATA_DIR)   # one row per dispatch entry (spark.schema.DISPATCH)

Modules: `source` and `dispatch_source` (the two formats; `source` also holds the backfill
writer), `_codec` (part files to Arrow and back, numpy/pyarrow only), `backfill`, `audit`,
`replay`, `export` (jobs: `DataFrame -> DataFrame` functions plus one function doing the I/O),
`session`, `progress`. The byte layouts come from `storage`; nothing here redefines one.
"""

"""Types of the compiled record header (storage/_record_header.pyx)."""

def header(length: int, due_ms: int, enqueue_ms: int, id_len: int, topic_len: int, tags_len: int, keys_len: int,
           props_len: int, body_len: int, crc: int) -> bytes: ...

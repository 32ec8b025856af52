"""On-disk formats, one module each holding both directions (writer and reader)."""

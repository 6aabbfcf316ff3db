"""One module per architecture: its catalogue entry, presets and converters, as data (see moezoo.registry)."""

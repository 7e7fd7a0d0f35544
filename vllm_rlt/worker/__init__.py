"""Device side: per-slot state, pass metadata and the model runner."""

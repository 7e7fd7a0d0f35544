"""Training of the built-in looped model (run as a module; never imported by the engine)."""

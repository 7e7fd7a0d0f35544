"""Engine: the step loop, the offline LLM API and output processing."""

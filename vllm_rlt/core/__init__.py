"""Host-side scheduling state: requests, the KV block pool, the scheduler and its contract."""

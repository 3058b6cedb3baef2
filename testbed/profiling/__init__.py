"""The profiler: measures the real engine's step latencies and writes profile tables."""

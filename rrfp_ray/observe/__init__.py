"""Observability: the telemetry format shared by the simulator and the runtime, Perfetto traces, diagrams."""

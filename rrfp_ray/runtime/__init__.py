"""The stage worker (compute and link threads), transports, the in-process pipeline and the synthetic workload."""

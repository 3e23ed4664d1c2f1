"""The discrete-event simulator, its lower bounds, and the variability traces it replays."""

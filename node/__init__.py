"""The Shoal daemon: CLI, config, identity, hardware, services, training."""

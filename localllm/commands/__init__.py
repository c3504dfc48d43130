"""One module per CLI command; each exposes a click object named ``command``."""

"""A kit for plugin authors' tests: a scripted engine, loopback TLS, a fault-injecting harness, tiny random-weight models."""

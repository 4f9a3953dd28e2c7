"""The ``loopstack`` command: ``main`` parses arguments; one module per command group."""

"""loopstack's built-in plugins, one module per technique.

They are registered through the same path as third-party plugins
(:func:`loopstack.plugins_catalog.discover`); see ``docs/writing-plugins.md``.
"""

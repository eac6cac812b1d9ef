"""The bottom layer: how every part declares its settings and registers itself."""

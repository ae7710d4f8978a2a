"""Synchronisation methods: one package per method (description, runtime, simulator model), and the registry."""

"""The model architectures, one file each, found through ``registry.py`` by config.json's ``architectures``;
their config and loader, and the tiny checkpoint maker."""

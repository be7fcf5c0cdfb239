"""The daemon's plumbing: the shared core, config flags, start-up checks, lifecycle, sd_notify, metrics, logging, process control."""

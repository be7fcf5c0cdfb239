"""The wire: messages and their codec, the field checks, the aux record and its slots, staging slots."""

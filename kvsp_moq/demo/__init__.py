"""`kvsp demo`: the whole system on one machine."""

"""kvsp-moq Placement Controller: instance lifecycle, routing and prefetch, sessions and
failover, resharding, and its HTTP app."""

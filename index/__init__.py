"""kvsp-moq Index Service: replica records (publish, lookup) and their stores (memory, Redis),
and `kvsp index`, which runs it with the Placement Controller (`pc`) or either alone."""

"""kvsp-moq relay service."""

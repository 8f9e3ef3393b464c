"""kvsp-moq agent service."""

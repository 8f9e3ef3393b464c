"""kvsp-moq index service."""

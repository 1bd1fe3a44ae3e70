"""Rewards: outcome from tests, the concave length penalty, auxiliary signals, composition."""

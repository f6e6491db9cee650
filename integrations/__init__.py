"""Add-ons for trainers people already run."""

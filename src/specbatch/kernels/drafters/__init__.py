"""Drafters: prompt lookup, a separate draft model, and the MTP head (``base.Drafter``)."""

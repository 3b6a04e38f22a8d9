"""Entitlement: projects ito-compute booking events and issues signed, short-lived eligibility."""

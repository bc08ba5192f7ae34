"""The scaler: sizes and heals the fleet through a provider's container API (not built yet)."""

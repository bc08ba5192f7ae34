"""The scaler: keeps the fleet the right size and healthy through a provider's API.

`provider.Provider` is the interface every provider implements (local processes now; SaladCloud
container groups and spot VMs next); `local.LocalProcessProvider` runs workers as child
processes on this machine for `lorafleet up` and `lorafleet demo`.
"""

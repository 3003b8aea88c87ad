module example.invalid/fence/clients/go

go 1.19

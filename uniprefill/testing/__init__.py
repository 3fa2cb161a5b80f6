"""Testing aids shipped with the package: the eager reference of token dropping and the
differential fuzzer (`uniprefill fuzz`). Nothing here is imported by `import uniprefill`."""

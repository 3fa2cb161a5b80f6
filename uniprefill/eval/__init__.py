"""uniprefill.eval"""

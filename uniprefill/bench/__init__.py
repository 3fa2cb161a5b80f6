"""uniprefill.bench"""

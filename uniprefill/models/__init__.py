"""uniprefill.models"""

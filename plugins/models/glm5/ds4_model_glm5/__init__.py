"""GLM 5.x model family plugin for ds4-core: GLM 5.2 (``glm-dsa``) and GLM 5.3 Flash (``glm5-next``)."""

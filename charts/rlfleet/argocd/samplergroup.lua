-- Argo CD health check for rlfleet.dev/SamplerGroup (Argo CD runs gopher-lua, i.e. Lua 5.1).
-- Healthy only when observedGeneration == metadata.generation and Ready is True.
-- Degraded on CollapseRisk True, phase Failed, or a quarantined group (it gets no new sessions).
-- Some replicas not ready (phase Degraded) is Progressing, like a Deployment mid-rollout.
local hs = { status = "Progressing", message = "Waiting for the rlfleet operator to report status" }
local status = obj.status
if status == nil then
  return hs
end

local function condition(kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function explain(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return fallback
end

local collapse = condition("CollapseRisk")
if collapse ~= nil and collapse.status == "True" then
  hs.status = "Degraded"
  hs.message = "CollapseRisk: " .. explain(collapse, "collapse precursors detected")
  return hs
end
if status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = "Failed: " .. explain(condition("Ready"), "the group failed")
  return hs
end
if status.quarantined == true or status.phase == "Quarantined" then
  hs.status = "Degraded"
  hs.message = "Quarantined: " .. explain(nil, "the router sends this group no new sessions")
  return hs
end

local generation = obj.metadata.generation
if status.observedGeneration == nil or generation == nil or status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
if status.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = explain(nil, "Suspended (scaled to zero by its RLJob)")
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  local replicas = status.ready
  if replicas ~= nil and replicas ~= "" then
    hs.message = "Ready " .. replicas
  else
    hs.message = explain(ready, "Ready")
  end
  return hs
end
hs.message = explain(ready, "Not ready yet")
return hs

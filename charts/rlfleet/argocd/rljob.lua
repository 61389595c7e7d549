-- Argo CD health check for rlfleet.dev/RLJob (Argo CD runs gopher-lua, i.e. Lua 5.1).
-- Healthy only when the operator has computed the status from the current spec (observedGeneration
-- == metadata.generation) and Ready is True, or the job has Succeeded. Degraded on CollapseRisk True or
-- phase Failed; for the current generation, Degraded when the operator says so (phase Degraded or condition
-- Degraded=True: the trainer or a group blocked, its WeightChannel's store unreachable). Suspended while
-- spec.suspend holds.
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
  hs.message = "Failed: " .. explain(condition("Ready"), "the job failed")
  return hs
end

local generation = obj.metadata.generation
if status.observedGeneration == nil or generation == nil or status.observedGeneration ~= generation then
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
if status.phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = explain(nil, "Suspended (spec.suspend is true)")
  return hs
end
if status.phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = explain(nil, "Succeeded")
  return hs
end

local degraded = condition("Degraded")
if degraded ~= nil and degraded.status ~= "True" then
  degraded = nil
end
if status.phase == "Degraded" or degraded ~= nil then
  -- the operator says Degraded only when something blocks the object (a pod the scheduler, the kubelet
  -- or a quota refuses, a crash loop, an unreachable store), never for replicas merely starting
  hs.status = "Degraded"
  local why = status.reason
  if degraded ~= nil and degraded.reason ~= nil and degraded.reason ~= "" then
    why = degraded.reason
  end
  if why == nil or why == "" then
    why = "Degraded"
  end
  hs.message = why .. ": " .. explain(degraded or condition("Ready"), "the job is blocked")
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = explain(ready, "Ready")
  return hs
end
hs.message = explain(ready, "Not ready yet")
return hs
